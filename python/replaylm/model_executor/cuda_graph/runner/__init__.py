"""Graph runners: one per phase; shapes, static buffers, padding, capture loop, replay."""
