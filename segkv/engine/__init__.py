"""The step loop, the async engine, detokenization and the conversations API."""
