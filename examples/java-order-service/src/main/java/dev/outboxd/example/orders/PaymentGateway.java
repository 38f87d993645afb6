package dev.outboxd.example.orders;

import org.springframework.stereotype.Component;

/**
 * A stand-in for the payment provider: it declines the well-known test card {@link #DECLINED_CARD} and
 * authorises every other. Called inside the confirmation's transaction, after the outbox event was written,
 * so a decline rolls back the event with the order's change.
 */
@Component
public class PaymentGateway {
    public static final String DECLINED_CARD = "4000000000000002";

    public void authorize(String orderId, String card) {
        if (DECLINED_CARD.equals(card)) {
            throw new PaymentDeclinedException(orderId);
        }
    }

    public static class PaymentDeclinedException extends RuntimeException {
        public PaymentDeclinedException(String orderId) {
            super("payment for order " + orderId + " was declined");
        }
    }
}
