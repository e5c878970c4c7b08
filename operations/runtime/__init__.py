"""pyinfra's run as gpuhost needs it: every patch of pyinfra's internals (checked against the
pinned pyinfra first), the link watch, commands sent from callbacks, the run's exit."""
