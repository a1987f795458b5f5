"""Process-wide helpers: what any part of the package may use, itself importing no other part of it."""
