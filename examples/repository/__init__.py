"""The example repository, shipped as package data (`hloserve.example_repository`) so that
`hloserve serve` from a wheel serves it as a source checkout does. Not a bundle: only
subdirectories with a manifest.yaml are."""
