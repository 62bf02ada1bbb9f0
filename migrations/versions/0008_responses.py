"""responses: stored OpenAI Responses API responses (previous_response_id, background retrieval)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'responses',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('previous_response_id', sa.String(length=40), nullable=True),
        sa.Column('background', sa.Boolean(), nullable=False),
        sa.Column('params', sa.JSON(), nullable=False),
        sa.Column('input_items', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_responses_job_id_jobs'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_responses_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_responses')),
    )
    op.create_index(op.f('ix_responses_job_id'), 'responses', ['job_id'], unique=False)
    op.create_index(op.f('ix_responses_tenant_id'), 'responses', ['tenant_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_responses_tenant_id'), table_name='responses')
    op.drop_index(op.f('ix_responses_job_id'), table_name='responses')
    op.drop_table('responses')
