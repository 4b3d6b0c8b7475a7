"""Process plumbing: progress reporting, allocator tuning, plot styling."""
