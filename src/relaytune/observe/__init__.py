"""What a run reports: metrics.jsonl, sessions.jsonl, progress and experiment trackers."""
