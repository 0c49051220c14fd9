"""Processes and their files: spawning, supervising, watching, scratch files, disk space."""
