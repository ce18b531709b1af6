"""What each worker role does on the shared engine host: ``prefill`` and ``decode``. A worker
switches role at run time; the role differences live here, not in the host."""
