"""lora adapters: PEFT folders over a registered model, per tenant or shared

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'adapters',
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('base_model', sa.String(length=128), nullable=False),
        sa.Column('source', sa.String(length=1024), nullable=False),
        sa.Column('tenant_id', sa.String(length=40), nullable=True),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('target_modules', sa.JSON(), nullable=False),
        sa.Column('pinned', sa.Boolean(), nullable=False),
        sa.Column('enabled', sa.Boolean(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapters_tenant_id_tenants'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_adapters')),
    )
    op.create_index(op.f('ix_adapters_tenant_id'), 'adapters', ['tenant_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_adapters_tenant_id'), table_name='adapters')
    op.drop_table('adapters')
