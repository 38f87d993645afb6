-- The order service's own tables. The outbox table (public.outbox_event, the pattern's reference schema) is
-- created by `outboxd migrate`, not here.
CREATE TABLE IF NOT EXISTS customer_order (
    order_id    uuid PRIMARY KEY,
    customer_id text NOT NULL,
    status      text NOT NULL CHECK (status IN ('PLACED', 'CONFIRMED', 'CANCELLED')),
    card        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS order_line (
    order_id uuid NOT NULL REFERENCES customer_order,
    sku      text NOT NULL,
    quantity integer NOT NULL CHECK (quantity > 0),
    PRIMARY KEY (order_id, sku)
);
