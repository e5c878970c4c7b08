"""torch.utils: sandbox stand-in."""
