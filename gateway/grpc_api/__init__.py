"""The client gRPC API (tandem.api.v1): proto messages to and from the API's typed records, served
by the same operations as the HTTP routes."""
