"""A database backend built on Django's PostgreSQL one, as PostGIS or a metrics wrapper is."""
