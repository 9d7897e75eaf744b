UPDATE idempotency_keys
SET lease_token = lease_token + 1, lease_owner = ?1,
    last_attempt_at = CASE WHEN lease_owner IS NULL THEN last_attempt_at
        ELSE MAX(COALESCE(last_attempt_at, created_at), lease_expires_at) END,
    may_have_acted = 1, lease_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?2,
    attempts = attempts + 1, updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    version = version + 1,
    history = CASE WHEN length(history) <= 14336 THEN history ELSE substr(substr(history, -14336),
        instr(substr(history, -14336),
        char(10)) + 1) END || char(10) || printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', version + 1, state,
        retryable, state, retryable, lease_token + 1, CAST(unixepoch('subsec') * 1000 AS INTEGER),
        length('sweeper'), 'sweeper',
        ifnull('|' || replace(replace(substr('sweeper took over an expired lease', 1, 512), '\',
        '\\'), char(10), '\n'), ''))
WHERE state = 'processing'
    AND (scope, key) IN ( SELECT scope,
        key FROM idempotency_keys WHERE state = 'processing'
        AND lease_expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)
        AND (next_check_at IS NULL OR next_check_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER))
        AND (?4 IS NULL OR scope = ?4) ORDER BY lease_expires_at LIMIT ?3)
RETURNING scope, key, operation, provider, provider_key, state, retryable, fingerprint, request,
    response_status, response_headers, response_body, error, lease_token, lease_owner,
    lease_expires_at, attempts, created_at, updated_at, expires_at, next_check_at, retention_ms,
    last_attempt_at, may_have_acted
