UPDATE idempotency_keys
SET state = 'done', retryable = FALSE, response_status = ?, response_headers = ?, response_body = ?,
    error = NULL, lease_owner = NULL, lease_expires_at = NULL, updated_at = UTC_TIMESTAMP(6),
    expires_at = UTC_TIMESTAMP(6) + INTERVAL (retention_ms * 1000) MICROSECOND,
    next_check_at = NULL, version = version + 1, last_actor = 'worker', last_reason = ?,
    claim_nonce = NULL
WHERE scope = ?
    AND `key` = ?
    AND state = 'processing'
    AND lease_token = ?
