"""oom-supervisor: keeps unattended fine-tuning jobs alive through OOMs and crashes."""

__version__ = "0.1.0"
