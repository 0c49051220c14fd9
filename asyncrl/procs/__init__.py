"""Processes and their files: spawning, supervising, watching, run locks, disk space."""
