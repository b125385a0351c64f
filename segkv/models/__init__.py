"""Model families, one file each, behind an explicit registry; the safetensors loader."""
