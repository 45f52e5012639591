-- pgvector holds the memories' embeddings. The embedded PostgreSQL ships it; elsewhere a
-- superuser may have to run CREATE EXTENSION vector once (see README, "Going to production").
CREATE EXTENSION IF NOT EXISTS vector;
