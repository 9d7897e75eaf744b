SELECT count(*) FILTER (WHERE state = 'processing') AS processing,
    count(*) FILTER (WHERE state = 'processing'
        AND lease_expires_at <= statement_timestamp()) AS stale,
    count(*) FILTER (WHERE state = 'done') AS done,
    count(*) FILTER (WHERE state = 'failed' AND retryable) AS failed_retryable,
    count(*) FILTER (WHERE state = 'failed' AND NOT retryable) AS failed_permanent,
    min(created_at) FILTER (WHERE state = 'processing') AS oldest_processing,
    statement_timestamp() AS db_now
FROM idempotency_keys
