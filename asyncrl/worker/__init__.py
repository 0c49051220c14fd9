"""The worker processes: the runtime that serves calls, weight transfer, export."""
