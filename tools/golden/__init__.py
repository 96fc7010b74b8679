"""The inputs the golden files under tests/golden/<kind>/ are rendered from, one module per kind."""
