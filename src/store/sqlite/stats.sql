SELECT COALESCE(SUM(state = 'processing'), 0) AS processing,
    COALESCE(SUM(state = 'processing'
        AND lease_expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)), 0) AS stale,
    COALESCE(SUM(state = 'done'), 0) AS done,
    COALESCE(SUM(state = 'failed' AND retryable = 1), 0) AS failed_retryable,
    COALESCE(SUM(state = 'failed' AND retryable = 0), 0) AS failed_permanent,
    MIN(CASE WHEN state = 'processing' THEN created_at END) AS oldest_processing,
    CAST(unixepoch('subsec') * 1000 AS INTEGER) AS db_now
FROM idempotency_keys
