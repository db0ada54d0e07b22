"""The start-up hook (`startup/`, put on the job's PYTHONPATH; it runs in the job's Python and
imports nothing from here) and the daemon-side reading of what it printed (`markers`)."""
