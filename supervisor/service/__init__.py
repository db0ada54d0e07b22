"""Telling people: notifications, webhooks, metrics, the report, systemd notify, logging."""
