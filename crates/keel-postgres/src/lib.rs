//! Keel's messaging Store on PostgreSQL.
