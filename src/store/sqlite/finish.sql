UPDATE idempotency_keys
SET state = ?3, retryable = ?4, response_status = ?5, response_headers = ?6, response_body = ?7,
    error = ?8, lease_token = CASE WHEN ?9 IS NULL THEN lease_token + 1 ELSE lease_token END,
    lease_owner = NULL, lease_expires_at = NULL,
    may_have_acted = CASE WHEN ?4 THEN 0 ELSE may_have_acted END,
    updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER),
    expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + retention_ms, next_check_at = NULL,
    version = version + 1,
    history = CASE WHEN length(history) <= 14336 THEN history ELSE substr(substr(history, -14336),
        instr(substr(history, -14336),
        char(10)) + 1) END || char(10) || printf('%s|%s|%s|%s|%s|%s|%s|%s|%s%s', version + 1, state,
        retryable, ?3, CASE WHEN ?4 THEN '1' ELSE '0' END,
        CASE WHEN ?9 IS NULL THEN lease_token + 1 ELSE lease_token END,
        CAST(unixepoch('subsec') * 1000 AS INTEGER), length(?10), ?10,
        ifnull('|' || replace(replace(substr(?11, 1, 512), '\', '\\'), char(10), '\n'), ''))
WHERE scope = ?1
    AND key = ?2
    AND (?9 IS NULL OR (state = 'processing' AND lease_token = ?9))
    AND (?12 IS NULL OR (state = 'processing' AND lease_token = ?12))
RETURNING scope, key, operation, provider, provider_key, state, retryable, fingerprint, request,
    response_status, response_headers, response_body, error, lease_token, lease_owner,
    lease_expires_at, attempts, created_at, updated_at, expires_at, next_check_at, retention_ms,
    last_attempt_at, may_have_acted
