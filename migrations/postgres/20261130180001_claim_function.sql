-- The claim as one function call (issue 12): a replay runs only the primary-key read below and
-- returns; the INSERT .. ON CONFLICT runs only for a key that is absent or claimable in the
-- snapshot of that read. Before, the claim was one statement whose INSERT node was set up (table,
-- three indexes, conflict projection) on every replay too. Same result row and same rules as
-- that statement: `claimed = true` with the new lease, `claimed = false` with the existing row,
-- no row when a concurrent claimer committed the key after the read (the store reads again).
-- History is still written by the trigger, inside this call.
CREATE FUNCTION idempotency_keys_claim(
    p_scope text, p_key text, p_operation text, p_provider text, p_provider_key text,
    p_fingerprint text, p_request text, p_owner text, p_lease_ms bigint, p_retention_ms bigint,
    p_window_ms bigint)
RETURNS TABLE (
    claimed boolean, last_reason text,
    scope text, key text, operation text, provider text, provider_key text, state text,
    retryable boolean, fingerprint text, request text, response_status integer,
    response_headers text, response_body bytea, error text, lease_token bigint,
    lease_owner text, lease_expires_at timestamptz, attempts integer, created_at timestamptz,
    updated_at timestamptz, expires_at timestamptz, next_check_at timestamptz,
    retention_ms bigint, last_attempt_at timestamptz, may_have_acted boolean,
    db_now timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    -- The read goes straight into the output columns: a replay returns them as they are.
    SELECT false, NULL, r.scope, r.key, r.operation, r.provider, r.provider_key, r.state,
        r.retryable, r.fingerprint, r.request, r.response_status, r.response_headers,
        r.response_body, r.error, r.lease_token, r.lease_owner, r.lease_expires_at, r.attempts,
        r.created_at, r.updated_at, r.expires_at, r.next_check_at, r.retention_ms,
        r.last_attempt_at, r.may_have_acted, statement_timestamp()
    INTO claimed, last_reason, scope, key, operation, provider, provider_key, state, retryable,
        fingerprint, request, response_status, response_headers, response_body, error,
        lease_token, lease_owner, lease_expires_at, attempts, created_at, updated_at,
        expires_at, next_check_at, retention_ms, last_attempt_at, may_have_acted, db_now
    FROM idempotency_keys AS r WHERE r.scope = p_scope AND r.key = p_key;
    -- Present and not claimable (the same rule as the ON CONFLICT .. WHERE below): a replay.
    IF FOUND AND NOT COALESCE(fingerprint = p_fingerprint AND (
            (state = 'failed' AND retryable)
            OR (p_window_ms IS NOT NULL AND state = 'processing'
                AND lease_expires_at <= statement_timestamp()
                AND created_at > statement_timestamp() - p_window_ms * interval '1 millisecond')),
            false) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    RETURN QUERY WITH ins AS (
        INSERT INTO idempotency_keys AS k (scope, key, operation, provider, provider_key, state,
            retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts,
            created_at, updated_at, retention_ms, version, last_actor, last_reason,
            last_attempt_at, may_have_acted)
        VALUES (p_scope, p_key, p_operation, p_provider, p_provider_key, 'processing', false,
            p_fingerprint, p_request,
            (extract(epoch from statement_timestamp()) * 1000000)::bigint, p_owner,
            statement_timestamp() + p_lease_ms * interval '1 millisecond', 1,
            statement_timestamp(), statement_timestamp(), p_retention_ms, 1, 'worker', 'claimed',
            statement_timestamp(), false)
        ON CONFLICT (scope, key) DO UPDATE SET
            state = 'processing', retryable = false,
            request = COALESCE(excluded.request, k.request),
            lease_token = k.lease_token + 1, lease_owner = excluded.lease_owner,
            lease_expires_at = excluded.lease_expires_at, attempts = k.attempts + 1,
            updated_at = excluded.updated_at, expires_at = NULL, next_check_at = NULL,
            error = NULL, response_status = NULL, response_headers = NULL, response_body = NULL,
            retention_ms = excluded.retention_ms, version = k.version + 1, last_actor = 'worker',
            last_attempt_at = excluded.last_attempt_at,
            may_have_acted = CASE WHEN k.state = 'failed' THEN k.may_have_acted ELSE true END,
            last_reason = CASE WHEN k.state = 'failed'
                THEN 'reclaimed after a retryable failure'
                ELSE 'retry took over an expired lease' END
        WHERE COALESCE(k.fingerprint = p_fingerprint AND (
            (k.state = 'failed' AND k.retryable)
            OR (p_window_ms IS NOT NULL AND k.state = 'processing'
                AND k.lease_expires_at <= statement_timestamp()
                AND k.created_at > statement_timestamp() - p_window_ms * interval '1 millisecond')),
            false)
        RETURNING k.*)
    SELECT true, ins.last_reason, ins.scope::text, ins.key::text, ins.operation, ins.provider,
        ins.provider_key, ins.state, ins.retryable, ins.fingerprint, ins.request,
        ins.response_status, ins.response_headers, ins.response_body, ins.error, ins.lease_token,
        ins.lease_owner, ins.lease_expires_at, ins.attempts, ins.created_at, ins.updated_at,
        ins.expires_at, ins.next_check_at, ins.retention_ms, ins.last_attempt_at,
        ins.may_have_acted, statement_timestamp()
    FROM ins;
END
$$;
