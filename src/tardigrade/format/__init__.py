"""The on-disk format (every version, 1 to 6): manifest schema and validation, limits, checksums,
safetensors data files. Knows bytes on disk; imports nothing from storage or above."""
