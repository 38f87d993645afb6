package dev.outboxd.example.orders;

import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.UUID;

import org.springframework.jdbc.core.namedparam.NamedParameterJdbcTemplate;
import org.springframework.stereotype.Service;
import org.springframework.transaction.annotation.Transactional;

/**
 * The order's state changes. Each method is one Spring-managed transaction holding the change of
 * {@code customer_order} and the outbox event that announces it: both commit, or neither does.
 */
@Service
public class OrderService {
    /** The events' aggregate type: outboxd's default topic for them is {@code outbox.Order}. */
    public static final String AGGREGATE = "Order";

    public record Line(String sku, int quantity) {}

    public record Order(UUID orderId, String customerId, String status, List<Line> lines) {}

    /** The event payloads (JSON in {@code outbox_event.payload}). */
    public record OrderPlaced(UUID orderId, String customerId, List<Line> lines) {}

    public record OrderConfirmed(UUID orderId, List<Line> lines) {}

    public record OrderCancelled(UUID orderId, String previousStatus) {}

    /** The order is not in a state that allows the change (confirming a cancelled order, say). */
    public static class InvalidTransitionException extends RuntimeException {
        public InvalidTransitionException(UUID orderId, String change) {
            super("order " + orderId + " cannot be " + change + " in its current state");
        }
    }

    private final NamedParameterJdbcTemplate jdbc;
    private final Outbox outbox;
    private final PaymentGateway payments;

    public OrderService(NamedParameterJdbcTemplate jdbc, Outbox outbox, PaymentGateway payments) {
        this.jdbc = jdbc;
        this.outbox = outbox;
        this.payments = payments;
    }

    @Transactional
    public UUID placeOrder(String customerId, String card, List<Line> lines) {
        UUID orderId = UUID.randomUUID();
        jdbc.update("""
                INSERT INTO customer_order (order_id, customer_id, status, card)
                VALUES (:orderId, :customerId, 'PLACED', :card)""",
                Map.of("orderId", orderId, "customerId", customerId, "card", card));
        for (Line line : lines) {
            jdbc.update("INSERT INTO order_line (order_id, sku, quantity) VALUES (:orderId, :sku, :quantity)",
                    Map.of("orderId", orderId, "sku", line.sku(), "quantity", line.quantity()));
        }
        outbox.emit(AGGREGATE, orderId.toString(), "OrderPlaced", new OrderPlaced(orderId, customerId, lines));
        return orderId;
    }

    /**
     * Confirms a placed order and charges it. The payment is authorised last, after the outbox event was
     * written: a decline throws, and the transaction, event included, rolls back.
     */
    @Transactional
    public void confirmOrder(UUID orderId) {
        String card = moveTo(orderId, "CONFIRMED", List.of("PLACED"), "confirmed");
        outbox.emit(AGGREGATE, orderId.toString(), "OrderConfirmed", new OrderConfirmed(orderId, lines(orderId)));
        payments.authorize(orderId.toString(), card);
    }

    @Transactional
    public void cancelOrder(UUID orderId) {
        String previous = currentStatus(orderId).orElseThrow(() -> new InvalidTransitionException(orderId, "cancelled"));
        moveTo(orderId, "CANCELLED", List.of("PLACED", "CONFIRMED"), "cancelled");
        outbox.emit(AGGREGATE, orderId.toString(), "OrderCancelled", new OrderCancelled(orderId, previous));
    }

    @Transactional(readOnly = true)
    public Optional<Order> find(UUID orderId) {
        return jdbc.query("SELECT customer_id, status FROM customer_order WHERE order_id = :orderId",
                        Map.of("orderId", orderId),
                        (row, n) -> new Order(orderId, row.getString(1), row.getString(2), lines(orderId)))
                .stream().findFirst();
    }

    /** Moves the order (row-locked) from one of {@code from} to {@code to}; returns its card. */
    private String moveTo(UUID orderId, String to, List<String> from, String change) {
        List<String> cards = jdbc.queryForList("""
                UPDATE customer_order SET status = :to, updated_at = now()
                WHERE order_id = :orderId AND status IN (:from) RETURNING card""",
                Map.of("orderId", orderId, "to", to, "from", from), String.class);
        if (cards.isEmpty()) {
            throw new InvalidTransitionException(orderId, change);
        }
        return cards.get(0);
    }

    private Optional<String> currentStatus(UUID orderId) {
        return jdbc.queryForList("SELECT status FROM customer_order WHERE order_id = :orderId FOR UPDATE",
                Map.of("orderId", orderId), String.class).stream().findFirst();
    }

    private List<Line> lines(UUID orderId) {
        return jdbc.query("SELECT sku, quantity FROM order_line WHERE order_id = :orderId ORDER BY sku",
                Map.of("orderId", orderId), (row, n) -> new Line(row.getString(1), row.getInt(2)));
    }
}
