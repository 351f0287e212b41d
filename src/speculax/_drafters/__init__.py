"""What the loop drafts from besides a draft model: drafters without weights."""
