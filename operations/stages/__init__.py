"""The pyinfra operations deploy.py and bench.py call: NVIDIA, the ML venv, the server, the router,
TLS, the gates, observability, the roll."""
