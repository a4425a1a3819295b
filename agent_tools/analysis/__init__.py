"""Pure tensor functions over captured attention: tensors in, tensors or floats out, inputs never modified."""
