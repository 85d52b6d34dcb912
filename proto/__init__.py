"""The wire: `pipeline.proto`, its generated modules, and the array codec."""
