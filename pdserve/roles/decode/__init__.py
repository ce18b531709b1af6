"""What the decode role does on the shared worker host: ``DecodePolicy`` turns
the prefill's KV handle into ``do_remote_prefill`` (or computes the prompt here when no
handle came).

Sits on ``pdserve.worker`` (the host), beside ``pdserve.roles.prefill``; neither role
imports the other.
"""
