"""Generated stubs for package tandem.api.v1 (run `make protos`); never edited by hand."""
