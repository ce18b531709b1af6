"""What the prefill role does on the shared worker host: ``PrefillPolicy``
(``do_remote_decode``, the push target, KV handles held under a lease and released on
abort or over the control channel).

Sits on ``pdserve.worker`` (the host), beside ``pdserve.roles.decode``; neither role
imports the other.
"""
