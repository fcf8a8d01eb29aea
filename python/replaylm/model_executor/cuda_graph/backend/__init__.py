"""Graph backends: how one shape is captured and replayed (full, breakable, tc_piecewise)."""
