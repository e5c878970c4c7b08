"""What the controller makes of the figures: the bench's report and diagnosis, published figures
beside ours, the fleet's status from Prometheus."""
