"""Generated stubs for package tandem.v1 (run `make protos`); never edited by hand."""
