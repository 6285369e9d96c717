"""A fourth engine, outside the package: one folder and one registry line (``hsx.engine.registry.register``)."""
