"""Building blocks of the models: each layer loads its own weights from a
`TensorSource` and runs on one flattened ragged batch of tokens [T, ...]."""
