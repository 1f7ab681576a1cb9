"""On-disk format v1: the manifest schema and the safetensors data files."""
