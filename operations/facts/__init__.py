"""What a host is: pyinfra facts and the parsers of the tools they run (nvidia-smi, apt, dpkg, the
venv, the model's copy)."""
