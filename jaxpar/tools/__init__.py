"""Commands that read or use a finished run: report, inspect, sample, export."""
