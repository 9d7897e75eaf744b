SELECT COUNT(CASE WHEN state = 'processing' THEN 1 END) AS processing,
    COUNT(CASE WHEN state = 'processing' AND lease_expires_at <= UTC_TIMESTAMP(6)
        THEN 1 END) AS stale,
    COUNT(CASE WHEN state = 'done' THEN 1 END) AS done,
    COUNT(CASE WHEN state = 'failed' AND retryable THEN 1 END) AS failed_retryable,
    COUNT(CASE WHEN state = 'failed' AND NOT retryable THEN 1 END) AS failed_permanent,
    MIN(CASE WHEN state = 'processing' THEN created_at END) AS oldest_processing,
    UTC_TIMESTAMP(6) AS db_now
FROM idempotency_keys
