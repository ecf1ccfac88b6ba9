"""The speculative engine: drafters propose, the target verifies, exact acceptance keeps."""
