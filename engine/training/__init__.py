"""Training a drafter head from the target on the user's machine (see job.py)."""
