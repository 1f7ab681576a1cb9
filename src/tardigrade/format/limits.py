"""Hard caps that keep a malicious or damaged checkpoint from exhausting memory or time."""

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap on a data file's JSON header
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_TENSORS_PER_FILE = 1_000_000
MAX_TENSORS = 4_000_000  # tensors listed by one manifest
MAX_FILES = 100_000  # data files listed by one manifest
MAX_TREE_NODES = 50_000_000
MAX_TREE_DEPTH = 200  # nesting of the state tree in the manifest
MAX_DIMS = 64
MAX_BOX_CHUNKS = 4096  # n-d chunks of one tensor checked pairwise for overlap
