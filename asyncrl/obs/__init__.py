"""Observability: logging and metrics, the terminal, the timeline and plots, the watchdog."""
