"""Everything that talks to PostgreSQL (the only package that imports psycopg)."""
