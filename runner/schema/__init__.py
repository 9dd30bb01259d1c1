"""JSON Schema made safe for hostile input, the scrubbing of the values it finds sensitive,
and strict JSON at the edges."""
