"""JSON Schema made safe for hostile input, and strict JSON at the edges."""
