"""The record: jobs, attempts and events in SQLite (store), and what attempts used (observations)."""
