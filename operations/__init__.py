"""gpuhost's pyinfra operations and facts: one module per concern."""
