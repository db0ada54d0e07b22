"""What went wrong and what to do next: diagnosis, policy, resume planning. Pure."""
